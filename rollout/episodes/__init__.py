"""Episodes: the turn loop that drives one or more engine turns per trajectory, the environment
sessions of a batch (--env), and the version pins that let a multi-turn episode finish on the
weights it started with."""
