"""The web console (console.py), served by the REST API's server."""
