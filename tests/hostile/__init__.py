"""The standing hostile-input harness: seeded mutations of every kind of input the project
reads, run through the public entry points in bounded child processes and judged against the
intact copy (docs/RELIABILITY.md, "The hostile-input harness")."""
