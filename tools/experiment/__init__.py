"""relaygr.tools.experiment: relay vs baseline under one fixed protocol, in parts (see ``command``)."""
