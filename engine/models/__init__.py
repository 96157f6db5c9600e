"""Model code: the MiMo-V2 architecture, its loader and random-checkpoint writer."""
