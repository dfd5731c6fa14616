"""What only the team's SkyPilot API server runs: the fleet's admin policy."""
