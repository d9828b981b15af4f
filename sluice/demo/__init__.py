"""`python -m sluice.demo` (run by `make demo`): the whole platform end to end on real servers."""
