"""Verdicts: the rules that judge a cell's ranks, the verdict they return, and its words."""
