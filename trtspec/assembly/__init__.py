"""Assembly: from a config to running engines. Resolves a config's model references (sources.py),
builds engine folders (build.py), checks they fit in memory (memory.py), and loads a folder into a
`Generator` (load.py), through the one registry of backends (backends.py). It sits above
`runtime` and `engines` and is the only layer that knows both."""
