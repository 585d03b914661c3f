"""The lab's shared package: timing, environment capture, records, roofline, checks, reports, CLI."""
