"""The rank side of distnb. Never imports controller modules; speaks only :mod:`distnb.wire.protocol`."""
