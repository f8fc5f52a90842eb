"""Loss landscapes: `barrier` (interpolation curves, barriers, planes, distances) and `plots`."""
