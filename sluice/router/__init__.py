"""Replica selection shared by the live routing service and the fleet simulator."""
