"""When things fire: cron, nominal times, misfire, rotation, backfills, exclusions, backoff,
the compact form.

Pure: nothing here does I/O.
"""
