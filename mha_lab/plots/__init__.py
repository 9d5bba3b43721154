"""Matplotlib figures the book shows, one module per topic; import the submodule you need.

Every function returns a ``matplotlib.figure.Figure`` with labelled axes and units, so a
chapter cell stays one line long.
"""
