"""Dash UI: talks to the API only."""
