"""What the test tiers share: fixtures' helpers, engine and cluster drivers run as subprocesses."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
"""The checkout's root (where the Makefile, deploy/ and helm/ are)."""
