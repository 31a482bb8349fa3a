"""decode_workers"""
