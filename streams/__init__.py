"""relaygr.streams"""
