"""Test support inside the package: fault hooks read from the environment (`faults`)."""
