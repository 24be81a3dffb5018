"""Concept balancing: assign concepts to images, count them, resample by inverse frequency (or MetaCLIP's rule)."""
