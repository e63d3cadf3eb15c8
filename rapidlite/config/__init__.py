"""The config layer: flag declarations as typed fields, the resolved sections, and the task registry."""
