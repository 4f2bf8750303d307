"""Operator tools: kvctl and kvtop."""
