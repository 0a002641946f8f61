"""Deployment: first-start engines per GPU type, and serving on a Ray cluster."""
