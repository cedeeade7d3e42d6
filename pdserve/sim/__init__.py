"""`pdserve simulate`: a discrete-event simulator of a pdserve cluster (docs/design.md, "The
simulator")."""
