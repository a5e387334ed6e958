"""The report of `megascope analyze` and its writers (text, JSON, HTML, Perfetto), with the
`analyze` and `export` commands."""
