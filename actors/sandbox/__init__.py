"""The sandbox for the Python code a model writes (its ``python`` tool): ``tool.py`` from the outside (limits, the
call, its result), ``runner.py`` from the inside (the program that builds the sandbox and runs the code)."""
