"""Two techniques written the way docs/architecture.md ("Add a technique") says, each one package that names no
other file of mtune's run: the tests register them with one registry line and check that the run, resume, the
planner and ``--fit`` see them (tests/mtune/training/memory/test_example_techniques.py)."""
