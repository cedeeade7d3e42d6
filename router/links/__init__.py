"""How the router reaches its nodes: the router's view of a node and the calls a node answers
(nodes.py), those calls over Ray (ray_nodes.py), and the token streams the nodes send their
deltas on (token_stream.py). Ray is loaded here and nowhere else in router/."""
