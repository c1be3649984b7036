"""HSTU attention kernels behind one entry point; imports nothing of the project but itself."""
