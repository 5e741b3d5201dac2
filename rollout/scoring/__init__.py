"""Scoring: the built-in rewards (--rm-type) with the guard every reward call runs under, and the
evaluation figures (mean reward, pass@k) of a prompt set."""
