"""relaygr.workers"""
