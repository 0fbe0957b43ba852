"""Test helpers shipped with the package: the two-halves harness, fault tools."""
