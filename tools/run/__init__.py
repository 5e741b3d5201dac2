"""The run: its configuration, the single-node launcher, the train loop, the torchrun entry
and its rank hosts, the driver watch, metrics and exit codes."""
