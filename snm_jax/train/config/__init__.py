"""Configs: dotted overrides and renamed fields, validation of every field before anything
expensive runs (`validation.validate`), and construction of a run's objects (`builders`)."""
