"""Benchmarks (`dflash-stream bench ...`): each prints its figures beside its baseline, measured in one run.

Benchmarks sit above every core package: they may import any part, and no core part imports them.
"""
