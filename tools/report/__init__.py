"""relaygr.tools.report: the report of a run, in parts (see ``command``)."""
