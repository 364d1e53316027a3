"""Stand-in for TE's compiled torch extension: megamoe's probe only imports it."""
