"""The benchmark scripts' one reader of their output: JSON objects one after another (`coli bench
--json` prints its report over several lines, so the files are not one object per line).

    from bench_runs import read_runs
"""
import json


def read_runs(path):
    """Every JSON object in the file at `path`, in order."""
    text = open(path).read()
    dec = json.JSONDecoder()
    runs, i = [], 0
    while i < len(text):
        if text[i].isspace():
            i += 1
            continue
        obj, i = dec.raw_decode(text, i)
        runs.append(obj)
    return runs
