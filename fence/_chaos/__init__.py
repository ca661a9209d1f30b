"""The chaos harness behind ``fence chaos``: workers, a pausing controller, a checker and a
timeline picture. Not a public API; run it through the command line."""
