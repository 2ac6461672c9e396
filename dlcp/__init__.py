"""The ``dlcp`` program: its top-level parser and dispatch, above every layer whose commands it gathers.

Each layer registers its own sub-commands (:mod:`dlcp.hostagent.cli`, :mod:`dlcp.topologies.commands`,
:mod:`dlcp_sim.cli`); this package only puts them under one name, so no layer below needs another
beside or above it.
"""
