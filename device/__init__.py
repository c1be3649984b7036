"""relaygr.device: the prepared accelerator check and the bundle it needs on a bare machine.

``relaygr bench device`` (``check``) runs its steps, each a child process with a time budget:
the machine (``probe``), then the micro-benchmarks of ``bench`` on the device, a profile of a
ranking (``profiling``), and a short pipeline experiment at points sized from the device's own
calibration (``points``); ``report`` writes what each step measured. ``bundle`` builds, on a
machine with a network, what the check needs on one without (``./dev device-bundle``).
"""
