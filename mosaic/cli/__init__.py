"""The `mosaic` command line."""
