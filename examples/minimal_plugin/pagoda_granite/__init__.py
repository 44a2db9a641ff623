"""pagoda-granite: IBM Granite for pagoda, the smallest third-party model plugin."""
