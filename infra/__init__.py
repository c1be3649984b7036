"""relaygr.infra"""
