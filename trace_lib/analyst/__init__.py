"""analyst"""
