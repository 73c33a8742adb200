"""Dask glue: the global-scheduler plugin, the llumlet worker plugin, comm transport, adaptive."""
