"""Code both sides of qerl import: config, wire types, tasks, AQN schedule, metrics, tiny model."""
