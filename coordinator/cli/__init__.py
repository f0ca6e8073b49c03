"""The command line: ``strata`` (main.py), ``strata bench`` (bench.py), ``strata make-model`` (make_model.py)."""
