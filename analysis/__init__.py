"""Figures and tables from prr results (importable as prr.analysis): style.py holds the one
colour per stage and per method, figures.py the figure functions and their registry,
make_figures.py the `make figures` command."""
