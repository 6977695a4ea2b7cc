"""keyroute: one-hop HTTP reads of partitioned state (the command line and the demo)."""
