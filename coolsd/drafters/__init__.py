"""Drafters: networks or procedures that propose draft tokens with their draft distributions."""
