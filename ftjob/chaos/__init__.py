"""ftjob.chaos"""
