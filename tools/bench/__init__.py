"""Benchmarks behind ``replayrl bench NAME``: each module is one benchmark with a ``main(argv)``;
``priority`` runs one ahead of other jobs, ``fault_injection`` holds the signalled actors of
``bench faults`` and the fault-tolerance tests."""
