"""The lab: checks and comparisons run by hand on lent GPU machines and on this CPU
machine (see lab/README.md). Not installed and never copied to hosts; run from the
repository's root as ``python3 -m lab.<name>``."""
