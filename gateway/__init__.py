"""conveyor's HTTP edge: routes, admission, reply dispatch."""
