"""relaygr.bench"""
