"""Where a run runs: the process group and mesh, the launcher (one process or torchrun), what a launcher or Slurm
says through the environment, preemption, the time budget, and the directories a run writes to."""
