"""Evaluation: prompt sets, run records, the generation runner, reports and loggers."""
